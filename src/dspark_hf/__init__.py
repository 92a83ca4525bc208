"""dspark_hf: DSpark speculative decoding for Hugging Face Transformers.

    import dspark_hf
    drafter = dspark_hf.DSparkDraftModel.from_pretrained("deepseek-ai/dspark_qwen3_8b_block7")
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)

Importing the package registers `DSparkConfig` / `DSparkDraftModel` with `AutoConfig` / `AutoModel` and installs the
`generate()` hook (see `dspark_hf.generation.hook`).
"""

from transformers import AutoConfig, AutoModel

from . import checkpoints  # registers the checkpoint-format resolver used by DSparkDraftModel.from_pretrained
from .attention_backends import decoding_attention
from .generation import DSparkCandidateGenerator, DSparkStats, install
from .models import DraftProposal, DSparkConfig, DSparkDraftModel

__version__ = "0.1.0"

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
install()

__all__ = ["DSparkCandidateGenerator", "DSparkConfig", "DSparkDraftModel", "DSparkStats", "DraftProposal", "__version__",
           "decoding_attention"]
