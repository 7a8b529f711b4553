"""Secure summation of client vectors (SecAgg+) and distributed discrete Gaussian noise, Flower-free.

* ``field``: float vectors <-> the ring Z_{2^bits}, with the stated quantization error bound;
* ``masking``: key agreement, the AES-CTR mask generator, the sparse neighbour graph, Shamir shares
  (Flower's ``flwr.common.secure_aggregation`` primitives where they fit);
* ``protocol``: the four-stage SecAgg+ client and server, dropouts up to the threshold, refusal past it;
* ``distributed_dp``: the discrete Gaussian sampler, each client's share of discrete Gaussian noise, the
  calibration and the RDP accounting of the sum (Kairouz, Liu & Steinke 2021);
* ``power``: FedPower's factored power iteration through secure sums of thin matrices.

docs/secure-aggregation.md derives what is implemented and states the trust assumption.
"""
