"""The random Llama targets of the GPU check (benchmarks/gpu_e2e.py builds them; gpu_preflight.py and
gpu_cli.py read their shapes): a module of its own so that no two check scripts import each other."""

# SmolLM2-135M's config.json (the packaged model, converted by specforge_k25/target_engine/models.py)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SMALL = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=2048)
