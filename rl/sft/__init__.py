"""The SFT warm start on the env expert's demonstrations (TRL's SFTTrainer), and the check of
whether it took."""
