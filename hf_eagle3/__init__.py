"""hf-eagle3: EAGLE-3 speculative decoding inside Hugging Face Transformers' ``generate``.

Importing the package registers :class:`Eagle3Config` / :class:`Eagle3DraftModel` with ``AutoConfig`` /
``AutoModel`` and hooks ``generate`` so that ``target.generate(ids, assistant_model=draft)`` runs EAGLE-3 decoding
whenever ``draft`` is an EAGLE-3 draft (with dynamic draft trees when ``tree_top_k`` / ``tree_depth`` /
``tree_total_tokens`` are given, see :mod:`hf_eagle3.core.decoding_loop`). The hook itself lives in
:mod:`hf_eagle3.core.generate_hook`.
"""

from transformers import AutoConfig, AutoModel

from .core.batch_drafter import Eagle3BatchTreeDrafter
from .core.candidate_generator import Eagle3CandidateGenerator
from .core.configuration_eagle3 import Eagle3Config
from .core.cost_model import calibrate, cost_table
from .core.draft_cache import Eagle3KVCache, Eagle3RowCache
from .core.feature_capture import Eagle3FeatureCapture, find_decoder_layers
from .core.generate_hook import install_generate_hook, is_eagle3_draft
from .core.logits_process import Eagle3D2TLogitsProcessor
from .core.modeling_eagle3 import Eagle3DraftModel
from .core.stats import Eagle3Stats
from .core.tree_drafter import DraftTree

__version__ = "0.2.0"

AutoConfig.register(Eagle3Config.model_type, Eagle3Config, exist_ok=True)
AutoModel.register(Eagle3Config, Eagle3DraftModel, exist_ok=True)
install_generate_hook()

__all__ = [
    "DraftTree",
    "Eagle3BatchTreeDrafter",
    "Eagle3CandidateGenerator",
    "Eagle3Config",
    "Eagle3D2TLogitsProcessor",
    "Eagle3DraftModel",
    "Eagle3FeatureCapture",
    "Eagle3KVCache",
    "Eagle3RowCache",
    "Eagle3Stats",
    "calibrate",
    "cost_table",
    "find_decoder_layers",
    "install_generate_hook",
    "is_eagle3_draft",
]
