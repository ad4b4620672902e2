"""EAGLE-3 draft head with DeepSeek multi-latent attention (served as `Eagle3DeepseekV2ForCausalLM`)."""
