"""Tests of dynamo_ftctl.gpu and the gpu/xid commands."""
