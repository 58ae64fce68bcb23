"""Hugging Face export: the converter (convert.py) and the modeling files it ships with the weights.

The modeling/configuration modules import transformers; import them only where it is installed.
"""
