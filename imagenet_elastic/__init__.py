"""ImageNet classifier training that runs under any launcher and survives restarts."""

__version__ = "0.1.0"
