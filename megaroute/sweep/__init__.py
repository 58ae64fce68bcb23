"""isoFLOP sweeps: spec -> planned points -> Slurm array tasks -> analysis from MLflow."""
