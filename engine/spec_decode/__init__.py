"""Speculative decoding: proposers draft tokens, the target model verifies them in one forward pass and
the rejection sampler keeps exactly the target's output distribution."""
