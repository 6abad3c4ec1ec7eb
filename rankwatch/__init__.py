"""rankwatch: trace every NCCL collective of a training job and name the rank behind a hang or slowdown."""

__version__ = "0.1.0"
