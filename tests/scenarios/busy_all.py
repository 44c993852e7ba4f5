"""no_hang: every rank computes (on CPU, no collective pending)."""

import _scenario as sc


def forward(n):
    return sum(i * i for i in range(n))


def train():
    while True:
        forward(20000)


sc.self_destruct()
sc.init_gloo()
sc.wait_for_go()
sc.ready_when_in("train")
train()
