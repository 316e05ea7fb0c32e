"""fedrl: federated and decentralized RL fine-tuning of language models."""

__version__ = "0.3.0"  # with pyproject.toml; 0.3.0: wire protocol 3 (fedrl.schema.PROTOCOL)
