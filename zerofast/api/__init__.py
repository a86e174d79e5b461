"""The public entry points that are not a step of the pipeline themselves: ``reconstruct``,
``load_into``, ``optimizer_state`` and ``sequential_names``. The package exports them from
``zerofast``. Importing one of these modules sets an attribute of ``zerofast.api``, never of
``zerofast``, so ``zerofast.reconstruct`` stays the function (no module shadows it)."""
