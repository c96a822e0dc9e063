"""Loss events from the last stage into DeepSpeed's configured monitors.

DeepSpeed's monitors write only on global rank 0, which in a pipeline is stage 0;
the stock engine broadcasts the loss there at the end of every batch. PACI removes
that cross-stage broadcast, so the last stage (data-parallel rank 0), which knows
the loss, writes the ``Train/Samples/train_loss`` events itself, to the same places
and in the same formats the configured CSV and TensorBoard monitors use
(``<output_path>/<job_name>/``). Rank 0 keeps writing its own events (learning rate,
evaluation loss) through DeepSpeed as usual. Weights & Biases and Comet keep
receiving rank 0's events only.
"""

import csv
import os


class LastStageMonitor:

    def __init__(self, monitor_config):
        self.csv_dir = None
        self.tb_writer = None
        self._csv_started = set()
        csv_cfg = monitor_config.csv_monitor
        if csv_cfg.enabled:
            self.csv_dir = os.path.join(csv_cfg.output_path or ".", csv_cfg.job_name)
            os.makedirs(self.csv_dir, exist_ok=True)
        tb_cfg = monitor_config.tensorboard
        if tb_cfg.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("the DeepSpeed config enables TensorBoard but the tensorboard package is not "
                                   "installed; pip install tensorboard or disable \"tensorboard\"") from e
            log_dir = os.path.join(tb_cfg.output_path or ".", tb_cfg.job_name)
            os.makedirs(log_dir, exist_ok=True)
            self.tb_writer = SummaryWriter(log_dir=log_dir)

    @property
    def enabled(self):
        return self.csv_dir is not None or self.tb_writer is not None

    def write_events(self, events):
        """``events``: ``[(name, value, step), ...]`` as DeepSpeed's monitors take them."""
        for name, value, step in events:
            if self.csv_dir is not None:
                filename = name.replace("/", "_").replace(" ", "_")
                with open(os.path.join(self.csv_dir, filename + ".csv"), "a+", newline="") as f:
                    writer = csv.writer(f)
                    if filename not in self._csv_started:
                        self._csv_started.add(filename)
                        writer.writerow(["step", name.split("/")[-1]])
                    writer.writerow([step, value])
            if self.tb_writer is not None:
                self.tb_writer.add_scalar(name, value, step)
        if self.tb_writer is not None:
            self.tb_writer.flush()
