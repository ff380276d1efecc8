"""The vendor kit: helpers a plugin's own code may build on (the request-state table and
sampler a model runner keeps, recurrent-state page access for linear-attention backends)."""
