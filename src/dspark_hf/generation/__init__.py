"""DSpark inside `generate()`: the candidate generator, the batch-1 loop for stateful targets, the hook; the batch-1
static-cache loop (`static_generate`, experimental)."""

from .candidate_generator import DSparkCandidateGenerator, DSparkStats
from .hook import install
from .stateful import stateful_generate
from .static_loop import static_generate
from .target_features import check_drafter_fits_target

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkStats",
    "check_drafter_fits_target",
    "install",
    "stateful_generate",
    "static_generate",
]
