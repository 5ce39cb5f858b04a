"""Composable components of a StreamRL run (one concept per module)."""

from streamrl.components.dispatch import Dispatcher, RandomDispatcher, RoundRobinDispatcher
from streamrl.components.elastic import ElasticController
from streamrl.components.generation_service import GeneratorError, StreamGenerationService
from streamrl.components.hf_generator import HFStreamGenerator
from streamrl.components.latency import LatencyModel
from streamrl.components.pipeline import DynamicBatchPipeline
from streamrl.components.profiler import Profiler
from streamrl.components.ranker import LengthRanker
from streamrl.components.schedulers import AdmissionScheduler, FIFOScheduler, LPTScheduler
from streamrl.components.skew_dispatch import SkewAwareDispatcher
from streamrl.components.weight_sync import AsyncWeightSync
from streamrl.components.weight_transport import WeightGroup

__all__ = [
    "AdmissionScheduler",
    "AsyncWeightSync",
    "Dispatcher",
    "DynamicBatchPipeline",
    "ElasticController",
    "FIFOScheduler",
    "GeneratorError",
    "HFStreamGenerator",
    "LPTScheduler",
    "LatencyModel",
    "LengthRanker",
    "Profiler",
    "RandomDispatcher",
    "RoundRobinDispatcher",
    "SkewAwareDispatcher",
    "StreamGenerationService",
    "WeightGroup",
]
