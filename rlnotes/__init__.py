"""rlnotes: RL fine-tuning for language models, equation by equation."""
# The version's one copy: pyproject.toml reads it ([tool.setuptools.dynamic]), `rlnotes --version`
# prints it, and every run's config.yaml records it (rlnotes.run.config_file).
__version__ = "0.1.0"
