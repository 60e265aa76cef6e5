"""dpmf: differentially private training with correlated noise."""

__version__ = "0.1.0"
