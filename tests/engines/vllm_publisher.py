"""A KV-event publisher built the way vLLM's ZmqEventPublisher is (libzmq through pyzmq,
msgpack), to prove kvroute's ZMTP and msgpack decoding against the real libraries.

Wire format as vLLM >= 0.26 sends it (vllm/distributed/kv_events.py): PUB messages
(topic, seq as 8-byte big-endian, payload); payload a msgpack array [ts, events, dp_rank];
events tagged maps. Replay: a ROUTER answering (identity, "", start seq) with
(identity, "", topic, seq, payload) per buffered batch and (identity, "", "", -1, "") at the end.

Usage: vllm_publisher.py PUB_PORT REPLAY_PORT BATCHES
Publishes BATCHES batches (a chain of blocks, each 4th batch removing an older one), the
first three before anyone can have subscribed and batch 5 not live (replay only), then
serves replay until killed. Prints "ready" once bound.
"""
import sys
import time

import msgpack
import zmq

BLOCK_SIZE = 2


def block_hash(i):
    # Above i64::MAX: vLLM's unsigned 64-bit hashes.
    return (1 << 63) + 1000 + i


def batch(i):
    events = [{
        "type": "BlockStored",
        "block_hashes": [block_hash(i)],
        "parent_block_hash": block_hash(i - 1) if i > 0 else None,
        "token_ids": [i, i + 1],
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }]
    if i % 4 == 3:
        events.append({"type": "BlockRemoved", "block_hashes": [block_hash(i - 2)], "medium": "GPU"})
    return msgpack.packb([time.time(), events, 0])


def main():
    pub_port, replay_port, batches = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    buffer = []
    topic = b""
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    print("ready", flush=True)

    def serve_replay(timeout_ms):
        for sock, _ in poller.poll(timeout_ms):
            frames = sock.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in buffer:
                if seq >= start:
                    sock.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    for seq in range(batches):
        payload = batch(seq)
        buffer.append((seq, payload))
        if seq >= 3 and seq != 5:
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        serve_replay(50)
    while True:
        serve_replay(1000)


if __name__ == "__main__":
    main()
