"""fedrl: federated and decentralized RL fine-tuning of language models."""

__version__ = "0.2.0"  # with pyproject.toml; 0.2.0: wire protocol 2 (fedrl.schema.PROTOCOL)
