"""Hugging Face export: the converter (convert.py), the modeling files it ships with the weights, and
bundle.py, which ships the megaroute modules those files use beside them (generated from this package).

The modeling/configuration modules import transformers; import them only where it is installed.
"""
