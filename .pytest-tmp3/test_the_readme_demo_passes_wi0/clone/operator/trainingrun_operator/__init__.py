"""trainingrun_operator: the TrainingRun API, the builders of its children, the CLI and the kopf operator."""

__version__ = "0.1.0"
