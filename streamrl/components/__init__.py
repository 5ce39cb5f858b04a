"""Pluggable components of a StreamRL run: generators and their admission schedulers."""

from streamrl.components.hf_generator import HFStreamGenerator
from streamrl.components.schedulers import AdmissionScheduler, FIFOScheduler

__all__ = ["AdmissionScheduler", "FIFOScheduler", "HFStreamGenerator"]
