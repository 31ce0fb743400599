"""kvnotes tests: real models, real Ray/gRPC/LMCache/Prometheus; slow ones are marked `slow` (CI runs them)."""
