"""The engine core's own process: its loop, torch threads and host memory settings."""
