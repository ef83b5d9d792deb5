"""An OpenAI-compatible HTTP server batching many requests through speculative decoding.

    from verispec.serving import ServeConfig, create_app
    app = create_app(ServeConfig(model_id="my-model"), load_model("my-model"), drafter)  # any ASGI server runs it
"""

from verispec.serving.app import ServeConfig, create_app
from verispec.serving.batch_cache import BatchedTarget, CompactionPolicy
from verispec.serving.batch_plan import BatchPlanner, PassCosts, PlanRow
from verispec.serving.gamma_policy import BatchGammaPolicy
from verispec.serving.lean_batch import LeanBatchedTarget
from verispec.serving.scheduler import GenerationRequest, QueueFullError, Scheduler, SchedulerConfig

__all__ = [
    "BatchGammaPolicy",
    "BatchPlanner",
    "BatchedTarget",
    "CompactionPolicy",
    "GenerationRequest",
    "LeanBatchedTarget",
    "PassCosts",
    "PlanRow",
    "QueueFullError",
    "Scheduler",
    "SchedulerConfig",
    "ServeConfig",
    "create_app",
]
