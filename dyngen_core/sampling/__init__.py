"""On-device, batched sampling (data plane). See `dyngen_core.sampling.sampler` for the stage
order, and `dyngen_core.engine.settings` for the settings and the per-job `SamplerState`."""

from dyngen_core.engine.record import SampleRequest
from dyngen_core.engine.settings import SamplerSettings, SamplerState
from dyngen_core.sampling.sampler import Sampler, SampleResult, SamplingError

__all__ = [
    "SampleRequest",
    "SampleResult",
    "Sampler",
    "SamplerSettings",
    "SamplerState",
    "SamplingError",
]
