"""Candidate S3 clients, measured against a local moto server (how the client was chosen).

Each candidate uploads one object as a parallel multipart upload and reads it back as
ranged GETs, several in flight.  The moto server runs in its own process on 127.0.0.1.

    python packages/dcp-storage-object/benchmarks/bench_clients.py --mib 256
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("moto server did not start")


def bench_obstore(url: str, bucket: str, data: bytes, part: int, conc: int, rng: int) -> tuple[float, float]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=url, access_key_id="x", secret_access_key="x", region="us-east-1",
                    client_options={"allow_http": True})
    t = time.perf_counter()
    obstore.put(store, "obj", data, use_multipart=True, chunk_size=part, max_concurrency=conc)
    up = time.perf_counter() - t
    starts = list(range(0, len(data), rng))
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        got = list(pool.map(lambda s: obstore.get_range(store, "obj", start=s, length=min(rng, len(data) - s)), starts))
    down = time.perf_counter() - t
    assert sum(len(g) for g in got) == len(data)
    return up, down


def _botocore_client(url: str, conc: int):
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=url, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1",
        config=botocore.config.Config(max_pool_connections=conc * 2, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def bench_botocore(url: str, bucket: str, data: bytes, part: int, conc: int, rng: int) -> tuple[float, float]:
    """Low-level botocore calls on our own thread pool (what storage_object does)."""
    client = _botocore_client(url, conc)
    view = memoryview(data)
    t = time.perf_counter()
    up_id = client.create_multipart_upload(Bucket=bucket, Key="obj")["UploadId"]

    def put(i: int) -> dict:
        body = view[i * part:(i + 1) * part]
        etag = client.upload_part(Bucket=bucket, Key="obj", UploadId=up_id, PartNumber=i + 1, Body=bytes(body))["ETag"]
        return {"ETag": etag, "PartNumber": i + 1}

    n = -(-len(data) // part)
    with cf.ThreadPoolExecutor(conc) as pool:
        parts = list(pool.map(put, range(n)))
    client.complete_multipart_upload(Bucket=bucket, Key="obj", UploadId=up_id, MultipartUpload={"Parts": parts})
    up = time.perf_counter() - t
    out = bytearray(len(data))
    dest = memoryview(out)
    starts = list(range(0, len(data), rng))

    def get(s: int) -> int:
        end = min(s + rng, len(data))
        body = client.get_object(Bucket=bucket, Key="obj", Range=f"bytes={s}-{end - 1}")["Body"]
        got = 0
        while got < end - s:
            k = body._raw_stream.readinto(dest[s + got:end])
            if not k:
                break
            got += k
        return got

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        assert sum(pool.map(get, starts)) == len(data)
    down = time.perf_counter() - t
    assert out == data
    return up, down


def bench_boto3(url: str, bucket: str, data: bytes, part: int, conc: int, rng: int) -> tuple[float, float]:
    """boto3's managed transfer (s3transfer) for the upload."""
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=url, aws_access_key_id="x", aws_secret_access_key="x",
                          region_name="us-east-1")
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    t = time.perf_counter()
    client.upload_fileobj(io.BytesIO(data), bucket, "obj", Config=cfg)
    up = time.perf_counter() - t
    starts = list(range(0, len(data), rng))
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        got = list(pool.map(lambda s: client.get_object(Bucket=bucket, Key="obj",
                                                        Range=f"bytes={s}-{min(s + rng, len(data)) - 1}")["Body"].read(),
                            starts))
    down = time.perf_counter() - t
    assert sum(len(g) for g in got) == len(data)
    return up, down


def bench_s3fs(url: str, bucket: str, data: bytes, part: int, conc: int, rng: int) -> tuple[float, float]:
    import s3fs

    fs = s3fs.S3FileSystem(key="x", secret="x", client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
                           max_concurrency=conc, skip_instance_cache=True)
    t = time.perf_counter()
    with fs.open(f"{bucket}/obj", "wb", block_size=part) as f:
        f.write(data)
    up = time.perf_counter() - t
    starts = list(range(0, len(data), rng))
    t = time.perf_counter()
    got = fs.cat_ranges([f"{bucket}/obj"] * len(starts), starts, [min(s + rng, len(data)) for s in starts])
    down = time.perf_counter() - t
    assert sum(len(g) for g in got) == len(data)
    return up, down


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--range-mib", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--clients", default="obstore,botocore,boto3,s3fs")
    a = p.parse_args()
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    proc, url = start_moto()
    try:
        import boto3

        data = os.urandom(a.mib << 20)
        fns = {"obstore": bench_obstore, "botocore": bench_botocore, "boto3": bench_boto3, "s3fs": bench_s3fs}
        s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id="x", aws_secret_access_key="x",
                          region_name="us-east-1")
        for name in a.clients.split(","):
            best_up = best_down = float("inf")
            for r in range(a.repeat):
                bucket = f"b-{name}-{r}"
                s3.create_bucket(Bucket=bucket)
                up, down = fns[name](url, bucket, data, a.part_mib << 20, a.concurrency, a.range_mib << 20)
                best_up, best_down = min(best_up, up), min(best_down, down)
                s3.delete_object(Bucket=bucket, Key="obj")
            print(f"{name:9s} multipart upload {a.mib / best_up:7.1f} MiB/s   ranged GET {a.mib / best_down:7.1f} MiB/s",
                  flush=True)
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
