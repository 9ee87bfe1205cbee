"""Tenancy: API keys -> tenants and tiers, quota admission, priorities, request timelines.

Everything here is backed by Redis so any number of gateway replicas act as one.
"""
