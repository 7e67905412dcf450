"""shoal.v1: generated from protos/shoal/v1 by tools/gen_protos.py. Do not edit."""
