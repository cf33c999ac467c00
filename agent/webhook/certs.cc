#include "agent/webhook/certs.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusekeeper::webhook {
namespace {

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using PKey = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

absl::Status OpenSslError(const char* what) {
  return absl::InternalError(absl::StrCat(what, " failed (OpenSSL)"));
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> KeyPem(EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslError("writing a private key");
  }
  return BioText(bio.get());
}

absl::StatusOr<std::string> CertPem(X509* cert) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) return OpenSslError("writing a certificate");
  return BioText(bio.get());
}

bool AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key` named `cn`, valid for `validity`, with a random serial; not signed yet.
Cert NewCert(EVP_PKEY* key, const std::string& cn, absl::Duration validity) {
  Cert cert(X509_new());
  if (!cert) return nullptr;
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return nullptr;
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  const bool ok = bn != nullptr && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr &&
                  X509_set_version(cert.get(), 2) == 1 &&
                  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -300) != nullptr &&  // clock skew
                  X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(validity)) != nullptr &&
                  X509_set_pubkey(cert.get(), key) == 1 &&
                  X509_NAME_add_entry_by_txt(X509_get_subject_name(cert.get()), "CN", MBSTRING_ASC,
                                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0) == 1;
  BN_free(bn);
  return ok ? std::move(cert) : nullptr;
}

absl::StatusOr<PKey> ReadKey(const std::string& pem) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  PKey key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (!key) return OpenSslError("reading a private key");
  return key;
}

absl::StatusOr<Cert> ReadCert(const std::string& pem) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Cert cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (!cert) return OpenSslError("reading a certificate");
  return cert;
}

}  // namespace

absl::StatusOr<KeyAndCert> MakeCa(const std::string& common_name, absl::Duration validity) {
  PKey key(EVP_EC_gen("P-256"));
  if (!key) return OpenSslError("generating an EC key");
  Cert cert = NewCert(key.get(), common_name, validity);
  if (!cert || X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) != 1 ||
      !AddExtension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0") ||
      !AddExtension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign") ||
      !AddExtension(cert.get(), cert.get(), NID_subject_key_identifier, "hash") ||
      X509_sign(cert.get(), key.get(), EVP_sha256()) == 0) {
    return OpenSslError("making the CA certificate");
  }
  auto k = KeyPem(key.get());
  auto c = CertPem(cert.get());
  if (!k.ok()) return k.status();
  if (!c.ok()) return c.status();
  return KeyAndCert{*k, *c};
}

absl::StatusOr<KeyAndCert> IssueServing(const KeyAndCert& ca, const std::vector<std::string>& dns_names,
                                        absl::Duration validity) {
  if (dns_names.empty()) return absl::InvalidArgumentError("a serving certificate needs at least one DNS name");
  auto ca_key = ReadKey(ca.key_pem);
  if (!ca_key.ok()) return ca_key.status();
  auto ca_cert = ReadCert(ca.cert_pem);
  if (!ca_cert.ok()) return ca_cert.status();
  PKey key(EVP_EC_gen("P-256"));
  if (!key) return OpenSslError("generating an EC key");
  std::vector<std::string> sans;
  for (const auto& n : dns_names) sans.push_back(absl::StrCat("DNS:", n));
  Cert cert = NewCert(key.get(), dns_names[0], validity);
  if (!cert || X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_cert->get())) != 1 ||
      !AddExtension(cert.get(), ca_cert->get(), NID_basic_constraints, "critical,CA:FALSE") ||
      !AddExtension(cert.get(), ca_cert->get(), NID_key_usage, "critical,digitalSignature") ||
      !AddExtension(cert.get(), ca_cert->get(), NID_ext_key_usage, "serverAuth") ||
      !AddExtension(cert.get(), ca_cert->get(), NID_authority_key_identifier, "keyid:always") ||
      !AddExtension(cert.get(), ca_cert->get(), NID_subject_alt_name, absl::StrJoin(sans, ",")) ||
      X509_sign(cert.get(), ca_key->get(), EVP_sha256()) == 0) {
    return OpenSslError("issuing the serving certificate");
  }
  auto k = KeyPem(key.get());
  auto c = CertPem(cert.get());
  if (!k.ok()) return k.status();
  if (!c.ok()) return c.status();
  return KeyAndCert{*k, *c};
}

absl::StatusOr<absl::Time> NotAfter(const std::string& cert_pem) {
  auto cert = ReadCert(cert_pem);
  if (!cert.ok()) return cert.status();
  struct tm t{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert->get()), &t) != 1) return OpenSslError("reading notAfter");
  return absl::FromTM(t, absl::UTCTimeZone());
}

}  // namespace fusekeeper::webhook
