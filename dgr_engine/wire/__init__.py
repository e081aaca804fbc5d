"""What a worker and its clients share: frames (``frames``), the status <-> gRPC mapping
(``status``), the capability advert (``advert``) and the generated protobuf code (``proto``)."""
