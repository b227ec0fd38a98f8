"""The parts of scripts/recall_curve.py: the job (job), its processes (runs), its report (results)."""
