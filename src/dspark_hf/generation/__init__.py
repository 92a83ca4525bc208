"""DSpark inside `generate()`: the candidate generator, the batch-1 loop for stateful targets, the hook; the batch-1
static-cache loop (`static_generate`, experimental), its per-stage round profile (`profile_static_round`) and the fused
projections it sets up (`unfuse_projections` undoes them); greedy batched decoding on static caches with a write
position per row (`static_generate_batch`, experimental); `compile_layers_once`, which makes torch.compile trace a
target's decoder layer once rather than once per layer."""

from .candidate_generator import DSparkCandidateGenerator, DSparkStats
from .compile_regions import compile_layers_once
from .fused_projections import fuse_projections, unfuse_projections
from .hook import install
from .stateful import stateful_generate
from .static_batch import static_generate_batch
from .static_loop import static_generate
from .static_profile import StaticRoundProfile, profile_static_round
from .target_features import check_drafter_fits_target

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkStats",
    "StaticRoundProfile",
    "check_drafter_fits_target",
    "compile_layers_once",
    "fuse_projections",
    "install",
    "profile_static_round",
    "stateful_generate",
    "static_generate",
    "static_generate_batch",
    "unfuse_projections",
]
