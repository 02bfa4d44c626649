{{- define "trainingrun.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "trainingrun.labels" -}}
app.kubernetes.io/name: trainingrun-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "trainingrun.selector" -}}
app.kubernetes.io/name: trainingrun-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "trainingrun.serviceAccount" -}}
{{- default (include "trainingrun.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* What the operator may do to the resources it manages, in every namespace it watches. */}}
{{- define "trainingrun.namespacedRules" -}}
- apiGroups: [trainingrun.dev]
  resources: [trainingruns]
  verbs: [get, list, watch]
- apiGroups: [trainingrun.dev]
  resources: [trainingruns/status]
  verbs: [patch]
- apiGroups: [trainingrun.dev]
  resources: [trainingruns/finalizers]
  verbs: [update]
{{- if ne .Values.backend "JobSet" }}
- apiGroups: [kubeflow.org]
  resources: [pytorchjobs]
  verbs: [get, list, watch, create, patch, delete]  # get: an existing job checked before it is used
{{- end }}
{{- if ne .Values.backend "PyTorchJob" }}
- apiGroups: [jobset.x-k8s.io]
  resources: [jobsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch]  # a JobSet's Jobs: which pods are its own, and how many it replaced
{{- end }}
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
{{- if and (gt (int .Values.replicaCount) 1) .Values.watchNamespaces }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, get, patch]
{{- end }}
{{- end -}}

{{/* The operator image: repository@digest when image.digest is set (what a scanner or admission policy can pin), else repository:tag. */}}
{{- define "trainingrun.operatorImage" -}}
{{- if .Values.image.digest -}}{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}
{{- end -}}

{{/* The trainer image for runs without spec.image: trainer.image with its tag replaced by trainer.imageDigest when set. */}}
{{- define "trainingrun.trainerImage" -}}
{{- if .Values.trainer.imageDigest -}}{{ regexReplaceAll ":[^:/@]+$" (.Values.trainer.image | splitList "@" | first) "" }}@{{ .Values.trainer.imageDigest }}
{{- else -}}{{ .Values.trainer.image }}{{- end -}}
{{- end -}}

{{/* The report endpoint's Service, its URL as trainer pods use it, and the Secret with its certificate. */}}
{{- define "trainingrun.reportService" -}}{{ include "trainingrun.fullname" . }}-report{{- end -}}
{{/* The EndpointSlice the acting replica makes for that Service (serving.ENDPOINT_SLICE_SUFFIX). */}}
{{- define "trainingrun.reportEndpointSlice" -}}{{ include "trainingrun.reportService" . }}-acting{{- end -}}
{{- define "trainingrun.reportUrl" -}}
https://{{ include "trainingrun.reportService" . }}.{{ .Release.Namespace }}.svc:{{ .Values.report.port }}/v1/reports
{{- end -}}
{{- define "trainingrun.reportTlsSecret" -}}
{{- .Values.report.tlsSecret | default (printf "%s-report-tls" (include "trainingrun.fullname" .)) -}}
{{- end -}}

{{/* The labels each backend's controller gives a trainer pod (beside the run's own): one list per backend the
operator may use, for the report endpoint's NetworkPolicy. */}}
{{- define "trainingrun.trainerPodLabels" -}}
{{- if ne .Values.backend "JobSet" }}
- [training.kubeflow.org/job-name, training.kubeflow.org/replica-type]
{{- end }}
{{- if ne .Values.backend "PyTorchJob" }}
- [jobset.sigs.k8s.io/jobset-name, batch.kubernetes.io/job-completion-index]
{{- end }}
{{- end -}}
