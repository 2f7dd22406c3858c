"""A bounded pipe between two processes: a fast producer is held back by a slow consumer.

The producer puts 200 numbered items into a pressure queue of bound 10 and closes it; the
consumer receives them (each acknowledged only once handled) until the queue is closed and
drained. Run it twice at once, or on two hosts, and the second producer waits for the first:
the producer role is exclusive.

    AMQP_URL=amqp://guest:guest@localhost:5672/%2F python examples/pressure_pipeline.py
"""

from __future__ import annotations

import multiprocessing
import time

from amqp_locks import PressureQueue, errors

NAME = "examples.pipeline"
ITEMS = 200
BOUND = 10


def produce() -> None:
    with PressureQueue(NAME) as q, q.producing(timeout=60) as p:  # url: $AMQP_URL
        for i in range(ITEMS):
            p.put(str(i).encode(), timeout=60)  # waits while 10 items are queued
        p.close()  # consumers drain what was put, then stop


def consume(results: multiprocessing.Queue[int]) -> None:
    with PressureQueue(NAME) as q:
        while True:
            try:
                with q.receive(timeout=60) as item:  # put back if this block raised
                    time.sleep(0.002)  # the slow part
                    results.put(int(item))
            except errors.QueueClosedError:
                return


def main() -> None:
    with PressureQueue(NAME) as q:
        if q.exists():
            q.delete(timeout=30)
        q.create(bound=BOUND)
        ctx = multiprocessing.get_context("spawn")
        results: multiprocessing.Queue[int] = ctx.Queue()
        workers = [ctx.Process(target=produce), ctx.Process(target=consume, args=(results,))]
        for w in workers:
            w.start()
        longest = 0
        got: list[int] = []
        while len(got) < ITEMS and any(w.is_alive() for w in workers):
            longest = max(longest, q.length())
            while not results.empty():
                got.append(results.get())
            time.sleep(0.005)
        for w in workers:
            w.join(60)
        while not results.empty():
            got.append(results.get())
        print(f"received {len(got)} items in order: {got == list(range(ITEMS))}")
        print(f"longest queue seen: {longest} (bound {BOUND}); stats: {q.stats()}")
        q.delete(timeout=30)
    assert got == list(range(ITEMS)) and longest <= BOUND


if __name__ == "__main__":
    main()
