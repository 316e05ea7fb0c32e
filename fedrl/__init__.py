"""fedrl: federated and decentralized RL fine-tuning of language models."""

# with pyproject.toml; 0.3.x: wire protocol 3 (fedrl.schema.PROTOCOL); 0.3.1: dg_eta and ppo_clip
__version__ = "0.3.1"
