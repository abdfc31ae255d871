"""The core: what a remote-code bundle carries next to a draft's weights (``hf-eagle3 export --remote-code``).

Every ``*.py`` file of this folder except this one is copied verbatim into the bundle, so the folder is flat (the
remote-code loader resolves ``from .x import y`` to a sibling file) and its files import only torch, transformers,
the standard library and each other (``tests/core/test_import_structure.py``).

The draft model
    ``configuration_eagle3`` (the config and its checks), ``config_layouts`` (published config layouts),
    ``checkpoint_files`` (weight files and tensor names), ``modeling_eagle3`` (the model), ``draft_layers``,
    ``draft_cache``, ``rope``.
The Transformers integration
    ``transformers_compat`` (every private Transformers name, the supported range), ``generate_hook``,
    ``auto_entry`` (the bundle's ``AutoModel`` entry), ``settings`` (the drafting settings), ``feature_capture``,
    ``stats``.
Drafting
    ``draft_state``, ``draft_steps`` (the forwards a round repeats, compiled on request), ``candidate_generator``
    (chains in Transformers' loop), ``tree_candidates`` (candidates and trees), ``drafter``
    (every row's tree, one draft forward per step), ``logits_process`` (draft vocabulary to target vocabulary).
Verifying
    ``acceptance``, ``target_cache``, ``stopping`` (stop checks on the host).
The loops
    ``decoding_loop`` (trees at every batch size, chains in batches; batch-1 chains run in Transformers' loop).
How much to draft
    ``cost_model`` (measured round costs), ``draft_length_policy`` (``"auto"`` for chains), ``tree_policy``
    (``"auto"`` for trees), ``batch_tail`` (what a round is worth to a batch that ends with its slowest row).
"""
