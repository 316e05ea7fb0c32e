"""fedrl: federated and decentralized RL fine-tuning of language models."""

__version__ = "0.1.0"
