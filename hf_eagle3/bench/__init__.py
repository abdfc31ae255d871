"""``hf-eagle3 bench``: plain ``generate`` against EAGLE-3 on the same prompts.

- :mod:`.run`: the single-row bench (:func:`~hf_eagle3.bench.run.run_bench`) and the command.
- :mod:`.strategies`: the strategy registry (plain, prompt lookup, chains, ``"auto"``, trees).
- :mod:`.report`: the markdown table, JSON and plot.
- :mod:`.batched`: batched ``generate`` against batched EAGLE-3 (``--batch-sizes``).
- :mod:`.oracle`, :mod:`.oracle_drafting`, :mod:`.synthetic`: the implementation's ceiling (``--oracle``), with a
  drafter that proposes what the target will say and random-weight targets of published shapes.
"""
