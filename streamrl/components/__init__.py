"""Composable components of a StreamRL run, grouped by the paper's concepts.

``generation`` (§3: the stream generation service, its instances and engines), ``skewness`` (§5:
length ranker, latency model, skew-aware dispatch, LPT), ``weights`` (§4.1, §6: weight sync and
transports), ``capacity`` (§4.2, §6: resource allocation, elastic scaling) and ``training``
(§4.1: dynamic-batch pipeline, off-policy correction). The user-facing names are importable
from here.
"""

from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.generation.engines import HFEngine, VLLMEngine
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
    "HFEngine",
    "HFStreamGenerator",
    "LPTScheduler",
    "LatencyModel",
    "LengthRanker",
    "Profiler",
    "RandomDispatcher",
    "RoundRobinDispatcher",
    "SkewAwareDispatcher",
    "StreamGenerationService",
    "VLLMEngine",
    "WeightGroup",
]
