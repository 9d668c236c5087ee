"""Install ds_recycle.

torch is deliberately left unpinned here: on a GPU machine the user's CUDA build is used as it is.
On a CPU machine, `launch/setup_venv.sh` installs the CPU build (torch==2.13.0) before this package,
so pip never pulls a CUDA build. deepspeed is pinned exactly: the engine subclasses its internals.
"""
from setuptools import find_packages, setup

setup(
    name="ds_recycle",
    version="0.1.0",
    description="ReCycle for DeepSpeed: keep pipeline-parallel training going through worker failures",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_recycle", "ds_recycle.*"]),
    install_requires=[
        "torch>=2.1",
        "deepspeed==0.19.8",
        "wandb",
        "matplotlib",
        "scipy",
        "ortools",
        "etcd3gw>=2.7",
    ],
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist", "ruff==0.17.6", "mypy==2.4.1"]},
    entry_points={"console_scripts": ["ds-recycle=ds_recycle.cli:console"]},
)
