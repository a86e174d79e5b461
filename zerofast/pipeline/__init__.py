"""Steps 1-3 composed (internal): :mod:`.prepare` discovers a checkpoint, loads it safely and
plans it, on top of both :mod:`zerofast.layouts` (steps 1-3 per kind of save) and
:mod:`zerofast.execute` (step 4, which depends on :mod:`zerofast.plan` and below only). The
entry points that read a state dict build on it: ``reconstruct``, ``load_into``,
``optimizer_state``, ``sequential_names`` (:mod:`zerofast.api`), ``export`` (:mod:`zerofast.hf`),
``to_dcp`` (:mod:`zerofast.writers.dcp`), ``diff`` and ``verify`` of an export
(:mod:`zerofast.checks`); :mod:`.prepare`'s docstring says which do not, and why.

Nothing is exported here: import from :mod:`.prepare`, so that ``zerofast.pipeline.prepare`` is
always the module, never the function it defines.
"""
