"""The module a remote-code bundle's ``auto_map`` points ``AutoModel`` to: it installs the ``generate`` hook and
re-exports the draft class, so that ``AutoModel.from_pretrained(bundle, trust_remote_code=True)`` followed by
``target.generate(ids, assistant_model=draft)`` runs EAGLE-3 decoding without ``hf_eagle3`` installed.

(``modeling_eagle3.py`` holds the draft model only and imports no decoding module.)
"""

from .generate_hook import install_generate_hook
from .modeling_eagle3 import Eagle3DraftModel

install_generate_hook()

__all__ = ["Eagle3DraftModel"]
