"""Checkpoint tools: ``hf-eagle3 export`` (:mod:`.export`: native, flat, speculators and remote-code layouts) and
``hf-eagle3 check`` (:mod:`.check`: what a draft is, whether it fits a target, which layer ids it reads)."""
