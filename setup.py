from setuptools import find_packages, setup

setup(
    name="ds_paci",
    version="0.1.0",
    description="Bubble-free PACI pipeline training for DeepSpeed: persistent 1F1B streams with stage-local steps",
    packages=find_packages(include=["ds_paci", "ds_paci.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.13.0",
        # the range ds_paci.core.seam.compat supports; `make setup` installs the newest, `make test-oldest` the oldest
        "deepspeed>=0.16.0,<=0.19.8",
        "transformers==5.24.0",
        "tokenizers==0.23.3",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist"],  # `make test` runs two workers (-n 2 --dist loadgroup)
        # What Megatron-DeepSpeed's pretrain_gpt.py and tools/preprocess_data.py import beyond ds_paci's own
        # dependencies: the integration test (tests/megatron) runs the real program. transformers is already ours.
        "megatron-test": ["pybind11==3.1.0", "regex==2026.11.19", "six==1.17.0", "einops==0.8.2", "nltk==3.10.4"],
    },
)
