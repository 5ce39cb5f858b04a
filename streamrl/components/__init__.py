"""Composable components of a StreamRL run (one concept per module)."""

from streamrl.components.dispatch import Dispatcher, RoundRobinDispatcher
from streamrl.components.generation_service import GeneratorError, StreamGenerationService
from streamrl.components.hf_generator import HFStreamGenerator
from streamrl.components.schedulers import AdmissionScheduler, FIFOScheduler
from streamrl.components.weight_transport import WeightGroup

__all__ = [
    "AdmissionScheduler",
    "Dispatcher",
    "FIFOScheduler",
    "GeneratorError",
    "HFStreamGenerator",
    "RoundRobinDispatcher",
    "StreamGenerationService",
    "WeightGroup",
]
