"""Client side: the ClientApp (compute and communication threads) and the volunteer SDK."""
