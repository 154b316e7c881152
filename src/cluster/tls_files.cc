#include "cluster/tls_files.h"

#include <fmt/format.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace orbitkv::cluster {

Result<std::string> ReadPemFile(std::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(fmt::format("{} {}: cannot read the file", flag, path));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return Status::InvalidArgument(fmt::format("{} {}: not a PEM file", flag, path));
  }
  return text.str();
}

std::string CertificateValidityProblem(const std::string& path) {
  BIO* bio = BIO_new_file(path.c_str(), "r");
  if (bio == nullptr) return std::string();
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) return std::string();
  const auto when = [](const ASN1_TIME* t) {
    std::string out;
    if (BIO* text = BIO_new(BIO_s_mem()); text != nullptr) {
      if (ASN1_TIME_print(text, t) == 1) {
        char* data = nullptr;
        const long n = BIO_get_mem_data(text, &data);
        if (n > 0) out.assign(data, static_cast<size_t>(n));
      }
      BIO_free(text);
    }
    return out;
  };
  std::string problem;
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) <= 0) {
    problem = "expired on " + when(X509_get0_notAfter(cert));
  } else if (X509_cmp_current_time(X509_get0_notBefore(cert)) >= 0) {
    problem = "not valid before " + when(X509_get0_notBefore(cert));
  }
  X509_free(cert);
  return problem;
}

std::vector<std::string> CertificateUris(const std::string& path) {
  std::vector<std::string> uris;
  BIO* bio = BIO_new_file(path.c_str(), "r");
  if (bio == nullptr) return uris;
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) return uris;
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type != GEN_URI) continue;
    const ASN1_IA5STRING* uri = name->d.uniformResourceIdentifier;
    uris.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)),
                      static_cast<size_t>(ASN1_STRING_length(uri)));
  }
  if (names != nullptr) GENERAL_NAMES_free(names);
  X509_free(cert);
  return uris;
}

Status ValidateTlsFiles(const TlsFiles& files) {
  if (files.ca.empty()) {
    return Status::InvalidArgument(
        fmt::format("TLS needs {} (the CA that signs the other side's certificate)", files.ca_flag));
  }
  if (files.cert.empty() != files.key.empty()) {
    return Status::InvalidArgument(
        fmt::format("{} and {} go together: give both or neither", files.cert_flag, files.key_flag));
  }
  ORBITKV_RETURN_IF_ERROR(ReadPemFile(files.ca_flag, files.ca).status());
  if (!files.cert.empty()) {
    ORBITKV_RETURN_IF_ERROR(ReadPemFile(files.cert_flag, files.cert).status());
    ORBITKV_RETURN_IF_ERROR(ReadPemFile(files.key_flag, files.key).status());
  }
  return Status::Ok();
}

namespace {

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(const TlsFiles& files) {
  const unsigned reload = std::max(1u, files.reload_secs);
  if (files.cert.empty()) {
    return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.ca, reload);
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert, files.ca, reload);
}

}  // namespace

Result<std::shared_ptr<grpc::ChannelCredentials>> WatchedChannelCredentials(const TlsFiles& files) {
  ORBITKV_RETURN_IF_ERROR(ValidateTlsFiles(files));
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(files));
  options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::experimental::TlsCredentials(options);
  if (credentials == nullptr) {
    return Status::InvalidArgument(
        fmt::format("gRPC refused the TLS options of {} / {} / {}", files.ca_flag, files.cert_flag, files.key_flag));
  }
  return credentials;
}

Result<std::shared_ptr<grpc::ServerCredentials>> WatchedServerCredentials(const TlsFiles& files) {
  ORBITKV_RETURN_IF_ERROR(ValidateTlsFiles(files));
  if (files.cert.empty()) {
    return Status::InvalidArgument(fmt::format("a TLS listener needs {} and {}", files.cert_flag, files.key_flag));
  }
  grpc::experimental::TlsServerCredentialsOptions options(Provider(files));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::experimental::TlsServerCredentials(options);
  if (credentials == nullptr) {
    return Status::InvalidArgument(
        fmt::format("gRPC refused the TLS options of {} / {} / {}", files.ca_flag, files.cert_flag, files.key_flag));
  }
  return credentials;
}

}  // namespace orbitkv::cluster
