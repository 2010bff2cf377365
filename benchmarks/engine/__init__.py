"""Engine benchmarks: the offline engine, the CPU race, speculation, structured output, quantization."""
