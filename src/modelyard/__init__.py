"""modelyard: one endpoint for every model on your GPUs."""

__version__ = "0.1.0"
