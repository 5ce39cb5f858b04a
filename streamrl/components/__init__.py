"""Composable components of a StreamRL run (one concept per module)."""

from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.components.generation.service import GeneratorError, StreamGenerationService
from streamrl.components.skewness.dispatch import Dispatcher, RandomDispatcher, RoundRobinDispatcher
from streamrl.components.skewness.latency import LatencyModel
from streamrl.components.skewness.profiler import Profiler
from streamrl.components.skewness.ranker import LengthRanker
from streamrl.components.skewness.schedulers import AdmissionScheduler, FIFOScheduler, LPTScheduler
from streamrl.components.skewness.skew_dispatch import SkewAwareDispatcher
from streamrl.components.training.pipeline import DynamicBatchPipeline
from streamrl.components.weights.sync import AsyncWeightSync
from streamrl.components.weights.transport import WeightGroup

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
