"""The algorithms (the config group `algo`), one module each: its train_step reads like its
algorithm, and its ALGORITHM at the end declares the rest (rlnotes.core.algorithm.Algorithm).
Importing one imports no other; the registry of all of them is rlnotes.algos.registry."""
