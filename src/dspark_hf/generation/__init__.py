"""DSpark inside `generate()`: the candidate generator, target-feature plumbing and the hook."""

from .candidate_generator import DSparkCandidateGenerator, DSparkStats
from .hook import install
from .target_features import check_drafter_fits_target, extract_target_features, hidden_states_request

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkStats",
    "check_drafter_fits_target",
    "extract_target_features",
    "hidden_states_request",
    "install",
]
